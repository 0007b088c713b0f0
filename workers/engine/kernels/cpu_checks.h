// Error messages of the CPU kernels' argument checks.
#pragma once

#include <cstdio>
#include <string>

namespace batchinfer {

// A check's message, printf-formatted, for TORCH_CHECK(cond, message(...).c_str()).
//
// TORCH_CHECK with several arguments streams them through an ostream inside this library,
// and streaming an integer there crashed (SIGSEGV in basic_ostream::_M_insert<long>) when
// built with Ubuntu 24.04's g++ 13 against torch 2.11's CUDA wheel on an Intel Xeon: that
// build carried its own instantiation of the stream code. snprintf needs none of it, and a
// single C string goes to c10 untouched. TORCH_CHECK evaluates its message only on failure.
template <typename... Args>
std::string message(const char* format, Args... args) {
  char text[256];
  std::snprintf(text, sizeof text, format, args...);
  return text;
}

}  // namespace batchinfer

"""The `batchinfer` command line: every role's entry point, the operator commands, and the
HTTP clients of the batch and job endpoints."""

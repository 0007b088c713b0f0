"""Helpers shared by the test suites: real service processes and settings for tests."""

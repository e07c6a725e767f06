"""Engines the worker can run; each turns GenerateRequests into token and done events."""

"""Backends: what the worker's socket server hands requests to (base.py has the contract)."""

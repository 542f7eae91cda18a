"""Leaf helpers every layer may use: formatting, hashing, logging, file locks. Imports nothing of ours."""

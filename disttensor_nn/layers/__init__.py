"""Distributed layers."""

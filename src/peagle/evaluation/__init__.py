"""Measuring heads: held-out acceptance ([`acceptance`], `peagle evaluate`) and timing utilities ([`timing`]).

Importing this package imports nothing heavy; import the submodules.
"""

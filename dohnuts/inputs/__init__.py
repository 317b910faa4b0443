"""Requests into tensors: the template, packed batches, pixels, the vocabulary and its token constants.

Nothing here runs a network.
"""

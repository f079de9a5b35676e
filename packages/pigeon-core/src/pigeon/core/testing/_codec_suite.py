"""Codec contract suite (filled in)."""

class CodecContract:
    pass


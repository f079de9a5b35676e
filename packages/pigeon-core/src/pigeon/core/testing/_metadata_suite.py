"""MetadataStore contract suite (filled in)."""

class MetadataStoreContract:
    pass


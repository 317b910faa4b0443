"""Decision records: sources (the synthetic mixture), partitions on disk, and the batch loader."""

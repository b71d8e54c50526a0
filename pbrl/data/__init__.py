"""What a run stores: Parquet schemas and typed rows, atomic storage, items and their sources, the replay store,
seeds."""

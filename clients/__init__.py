"""Everything that talks to edge nodes: EdgeDataset, node selection, the ops CLI."""

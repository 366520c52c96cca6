"""What both cache kinds share: shard files written in place, host staging, the async writer.
Imports no kind."""

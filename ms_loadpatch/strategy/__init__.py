"""The loading strategy, independent of how it is hooked into mindone:
read safetensors without extra copies, cast only what differs, assign with
O(1) bookkeeping, construct without initialising what the checkpoint overwrites."""

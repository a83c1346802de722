// Shard arithmetic for every layout (layout.h).

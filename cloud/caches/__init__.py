"""Which finished history's KV a new session reuses: whole-sequence entries for llama.cpp's KV cells
(``prefix_cache``), chained blocks for engines that keep each session's KV in its own tensors (``block_cache``).
Bookkeeping only: the engines (``cloud.engines``) copy the KV."""

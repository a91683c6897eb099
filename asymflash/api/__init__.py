"""The public entry points: dense, varlen, packed and kvcache attention."""

"""The capture engine: `DraftGraphs` (capture) over one draft iteration per batch bucket - the dispatcher, each
bucket's graph and its replay handle, the static buffers and their guards, recording per backend, the one compile the
buckets share and its caches, observers. It imports no model: any fn(slots, accepted, tokens, hidden) -> DraftOutput
(iteration) is captured."""

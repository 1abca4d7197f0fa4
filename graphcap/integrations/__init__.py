"""Engine integrations. `graphcap.integrations.sglang` is sglang's plugin (`--enable-draft-graph-capture`), loaded
through the `sglang.srt.plugins` entry point; it imports nothing from sglang until sglang calls it."""

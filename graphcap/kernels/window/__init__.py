"""The window ring's updates behind `graphcap.window.WindowBuffers`: `advance` in place and `reset` (`update`)."""

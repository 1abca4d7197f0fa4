"""Reference frozen-KV MTP draft model(s) built from a capture spec, and the draft loop graphcap captures."""
from graphcap.models.draft_loop import DraftLoop, DraftOutput
from graphcap.models.frozen_kv_draft import FrozenKVDraft, KVSource

__all__ = ["DraftLoop", "DraftOutput", "FrozenKVDraft", "KVSource"]

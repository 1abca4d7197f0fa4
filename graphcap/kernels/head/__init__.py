"""The draft head's picks from the logits: the centroid head's scores (`centroid`), its top-ks (`small_topk`) and the
greedy token among its candidates (`candidate_pick`)."""

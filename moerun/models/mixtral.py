"""Mixtral: GGUF architecture `llama` with expert tensors. The converter permutes Q/K
rows so that normal-style (adjacent pair) rope applies; top-K weights renormalised."""
from moerun.models.spec import ArchRule

RULE = ArchRule(family="mixtral", gguf_arch="llama", rope_style="norm", renormalize_topk=True)

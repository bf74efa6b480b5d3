"""OLMoE: q/k RMSNorm over the whole projection, NEOX rope, top-K weights not renormalised."""
from moerun.models.spec import ArchRule

RULE = ArchRule(family="olmoe", gguf_arch="olmoe", rope_style="neox", renormalize_topk=False)

"""Mixture-of-experts, device-free: the expert-executor interface the forward pass calls per
MoE layer (and the all-local executor), placements, the planner, routing counts."""

"""Hopper-native attention backward (sm_90a): TMA pipelines, wgmma, warp specialization."""

"""Choices of the attention backward's pre/post-processing that are not layouts: the grids the op
launches. The tiles are ``layouts/attention_bwd_prepost.py``."""

# ConvertDQReady: persistent CTAs per multiprocessor (each converts one 32-row tile at a time;
# not swept: enough for the idle multiprocessors of a last wave to stream the accumulator)
READY_CTAS_PER_SM = 8

"""The torch face: validated, torch.library-registered ops and autograd modules."""

from .dropout_bias import BiasDropout, bias_dropout, dropout_bias_backward

__all__ = ["BiasDropout", "bias_dropout", "dropout_bias_backward"]

"""The softmax in log2 units: exp(x) = exp2(x * LOG2_E). The attention kernels compute their
exponentials as exp2 and the preprocess hands the sm90 kernel its LSE already so scaled, so
the factor is defined once here."""

import math

LOG2_E = math.log2(math.e)

"""The softmax in log2 units: exp(x) = exp2(x * LOG2_E). The attention kernels compute their
exponentials as exp2 and the preprocess hands the sm90 kernel its LSE already so scaled, so
the factors are defined once here (LN_2: back to natural-log units, as torch's LSE is)."""

import math

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

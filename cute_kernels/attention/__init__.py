"""Parts shared by the attention kernels: masks, sequence lengths, tile schedulers, named
barriers, dropout and bias helpers."""

"""Every source of randomness pinned, the CPU mode (portable kernels or native), and the machine's fingerprint."""

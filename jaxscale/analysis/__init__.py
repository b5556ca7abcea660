"""What a compiled program costs and what it is compiled for: HLO statistics, the mesh axes of
each collective, TPU and GPU targets, MFU, and where a state's arrays live.
"""

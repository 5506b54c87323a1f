"""What crosses the network and the disk: codecs, the contribution upload format, int8
deltas between versions, and tensor files read and written piece by piece.
"""

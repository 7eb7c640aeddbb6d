"""DeepSeek-V3 MTP/NextN: the drafter, its checkpoint format and its training loss."""

"""SuffixDecoding: model-free drafts from suffix trees over the prompt and earlier outputs."""

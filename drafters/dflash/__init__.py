"""DFlash: the block backbone, the drafter, its checkpoint formats, its loss and its peer check."""

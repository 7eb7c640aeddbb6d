"""DFlash 2: DFlash's block backbone with a grouped dynamic convolution around every sublayer and a candidate path selector."""

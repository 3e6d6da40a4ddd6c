"""tfsmp.checkpoint"""

"""tfsmp.graph"""

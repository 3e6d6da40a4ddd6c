"""tfsmp.runtime"""

"""tfsmp.schedule"""

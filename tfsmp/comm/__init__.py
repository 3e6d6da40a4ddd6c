"""tfsmp.comm"""

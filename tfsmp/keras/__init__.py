"""tfsmp.keras"""

"""What a request may ask, checked when it is built: the layer every other one reads.

    settings.py  Settings: generation_config.json, config.json and the caller's overrides
    checks.py    each setting checked (CHECKS, field by field): SettingError names the field, the
                 value and the allowed range
    limits.py    the most one request may ask of a batch it shares (the HTTP layer declares the same)
    inputs.py    a request's prompts and seeds, checked at the boundary
"""

"""The architecture families, one folder each: ``<family>/__init__.py`` defines the family class
(its ``GPTSpec`` from an HF config, its HF <-> Megatron mapping, what it refuses) and registers it
with ``@register_architecture``. ``models/registry.py`` imports every folder here."""

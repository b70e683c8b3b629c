"""The floor the cache and its tiers meet on: what the cache tells a tier, and the
machinery every tier shares.

The cache calls its tiers through ``Tiers`` (tier.py: the ``Tier`` protocol, the fan-out,
``Miss``, the one value a request's miss travels as); each tier reports its state as a
``TierStats`` (stats.py), which the cache's stats carry by the tier's ``kind`` without
knowing its fields. The tiers (kvd/disk/, kvd/remote/) are built on ``Fetches``
(fetches.py: a prompt's pages past its local hit, brought from a tier's ``FetchSource``),
``Holds`` (holds.py: the pool references a tier holds) and places.py (where a published
page sits in its chain, and its seal). Nothing here names a tier, and nothing here imports
the cache: the cache lends a tier what it may use (kvd/cache/ports.py), and the fetches
see the cache's room and page events through the two small protocols fetches.py names.
"""

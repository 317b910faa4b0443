"""The upstream public mixture: 26 groups from public sources, converted into decision records.

`sources` holds the committed manifest (repositories, revisions, licenses, raw files and their
SHA-256), finds the raw files in the local cache and fetches them; `mixture` turns the selected
sources into validated states with the same checks as the user's records; one module per source
family (`text`, ...) converts its sources' own layouts.
"""

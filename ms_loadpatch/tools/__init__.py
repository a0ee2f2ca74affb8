"""User tools built on the plugin: `bench` (patched vs unpatched timings),
`verify` (a patched load compared with an unpatched one), and `_child` (what
runs in their fresh processes). The plugin core does not import them."""

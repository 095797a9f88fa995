"""`plait router`: replicas behind one address, requests sent where their prefix is likely cached."""

"""GPU knowledge: discovery behind one Protocol (provider.py and friends), allocation as pure logic."""

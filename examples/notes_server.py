"""A small MCP server written with the official SDK (FastMCP: ``MCPServer`` in mcp 2).
Publish what it offers to the swarm as agent ``notes``:
``p2pnode mcp publish --agent-id notes -- python notes_server.py``."""

from mcp.server.mcpserver import MCPServer

server = MCPServer("notes", instructions="Notes kept for the team")
notes: list[str] = []


@server.tool()
def add_note(text: str) -> int:
    """Keep a note; returns how many there are."""
    notes.append(text)
    return len(notes)


@server.resource("notes://all", mime_type="text/markdown")
def all_notes() -> str:
    """Every note, one per line."""
    return "\n".join(f"- {note}" for note in notes)


@server.prompt()
def summarize(topic: str) -> str:
    """Ask for a summary of the notes on a topic."""
    return f"Summarize the notes about {topic}."


if __name__ == "__main__":
    server.run()

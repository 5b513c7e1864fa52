// Notebook 05's message line (You [...] Send), the one part of gptlib's chat box that runs in the browser: an
// anywidget module (gptlib/widgets.py, MessageBox, says why). Enter or Send takes the typed text and empties the
// box in the same handler, before the browser handles the next key, and sends the text to the kernel as one
// message: a key typed right after Enter lands in the next message however long the kernel takes to answer, and a
// message sent while a reply is being made waits in the kernel's queue as its own turn. The kernel never writes
// into the box; it may only hand back a message it could not answer, which goes back into an empty box.

function render({ model, el }) {
  const line = document.createElement("div");
  const label = document.createElement("label");
  const box = document.createElement("input");
  const send = document.createElement("button");
  label.textContent = "You";
  label.style.cssText = "flex: 0 0 110px; text-align: right; padding-right: 8px; box-sizing: border-box";
  box.type = "text";
  box.placeholder = model.get("placeholder");
  box.style.cssText = "flex: 1 1 auto; min-width: 0; height: 28px; padding: 0 6px; border: 1px solid #9e9e9e";
  send.textContent = "Send";
  send.className = "jupyter-button widget-button mod-primary";
  send.style.cssText = "flex: 0 0 auto; width: auto; height: 28px; margin: 0 0 0 4px; padding: 0 16px";
  // Inside el, whose style ipywidgets' layout (width 95%, from the kernel) owns.
  line.style.cssText = "display: flex; align-items: center; margin: 2px 0";

  function take() {
    model.send({ text: box.value });
    box.value = "";
  }
  // The notebook's shortcuts would take the keys (a letter adds a cell or makes this one markdown).
  box.addEventListener("keypress", (event) => event.stopPropagation());
  box.addEventListener("keydown", (event) => {
    event.stopPropagation();
    if (event.key === "Enter" && !event.isComposing) {
      event.preventDefault();
      take();
    }
  });
  // Pressing Send leaves the focus in the box, so keys typed after a click land there.
  send.addEventListener("mousedown", (event) => event.preventDefault());
  send.addEventListener("click", () => {
    take();
    box.focus();
  });
  model.on("msg:custom", (msg) => {
    if (typeof msg.put_back === "string" && box.value === "") {
      box.value = msg.put_back;
    }
  });
  line.append(label, box, send);
  el.append(line);
}

export default { render };

// Runs gptlib/message_box.js (the chat's message line) in Node.js for tests/test_ui.py: a fake anywidget model and
// just enough of a DOM for its render(), with the browser's default actions the module relies on (a key that is
// not prevented types its letter; a mousedown that is not prevented moves the focus to its element).
// Usage: node tests/message_box_dom.mjs MODULE_PATH STEPS_JSON, where a step is ["type", "text"],
// ["key", "Enter"], ["click"] (Send, with the mouse) or ["put_back", "text"] (the kernel's message). Prints
// {sent, box, focus, type, placeholder, keys_to_notebook} as JSON.
import { readFileSync } from "node:fs";

class Element {
  constructor(tag) {
    Object.assign(this, { tagName: tag, children: [], listeners: {}, style: {}, className: "", value: "" });
  }
  append(...children) {
    this.children.push(...children);
  }
  addEventListener(type, listener) {
    (this.listeners[type] ??= []).push(listener);
  }
  // -> whether the event went on to the notebook (not stopped) and its default action may run (not prevented)
  dispatch(type, fields = {}) {
    const event = { type, stopped: false, prevented: false, ...fields };
    event.stopPropagation = () => (event.stopped = true);
    event.preventDefault = () => (event.prevented = true);
    for (const listener of this.listeners[type] ?? []) listener(event);
    return event;
  }
  focus() {
    document.activeElement = this;
  }
}
globalThis.document = { createElement: (tag) => new Element(tag), activeElement: null };

const [modulePath, stepsJson] = process.argv.slice(2);
const source = readFileSync(modulePath, "utf8");
const widget = (await import(`data:text/javascript;base64,${Buffer.from(source).toString("base64")}`)).default;
const sent = [];
const handlers = [];
const model = {
  get: (name) => ({ placeholder: "your message" })[name],
  send: (content) => sent.push(content),
  on: (name, handler) => name === "msg:custom" && handlers.push(handler),
};
const el = new Element("div");
widget.render({ model, el });
const all = (element) => [element, ...element.children.flatMap(all)];
const find = (tag) => all(el).find((element) => element.tagName === tag);
const box = find("input");
const button = find("button");
box.focus();

let keysToNotebook = 0;
function press(key) {
  const target = document.activeElement;
  const down = target.dispatch("keydown", { key, isComposing: false });
  const typed = target.dispatch("keypress", { key });
  keysToNotebook += !down.stopped || !typed.stopped;
  if (!down.prevented && key.length === 1 && target === box) box.value += key;
}
for (const [step, text] of JSON.parse(stepsJson)) {
  if (step === "type") [...text].forEach(press);
  else if (step === "key") press(text);
  else if (step === "click") {
    if (!button.dispatch("mousedown").prevented) button.focus();
    button.dispatch("click");
  } else if (step === "put_back") handlers.forEach((handler) => handler({ put_back: text }));
}
const focus = document.activeElement === box ? "box" : document.activeElement === button ? "Send" : "elsewhere";
const result = { sent, box: box.value, focus, type: box.type, placeholder: box.placeholder };
console.log(JSON.stringify({ ...result, keys_to_notebook: keysToNotebook }));

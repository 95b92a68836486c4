from rayeval.ui.cli import console_main

console_main()

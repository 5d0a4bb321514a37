from backroom.cli import main

main()
